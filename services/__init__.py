"""Dressage services, one package each; they talk only through Redis and HTTP, never import each other."""
