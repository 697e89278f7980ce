"""A task module that fails to import (tests of the task loader)."""

raise ImportError("this plugin needs a package that is not installed")
