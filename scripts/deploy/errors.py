"""The renderer's one error: parameters that cannot make a working deployment (the CLI exits 2 with it)."""


class DeployError(ValueError):
    """Parameters that cannot make a working deployment."""
