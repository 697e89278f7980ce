"""Inspecting a live deployment: ``dressage status``, its snapshot, process probes and heartbeat checks.

Read-only: everything here reads Redis (and /proc) and never writes to the deployment.
"""
