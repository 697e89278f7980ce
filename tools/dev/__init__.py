"""Setup and developer tools: the built-in datasets, tiny models, and the generated references (docs/cli.md,
docs/configuration.md).

None of these touches a running deployment.
"""
