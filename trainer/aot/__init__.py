"""Ahead-of-time compilation for TPU targets without a TPU (`python -m trainer.compile`)."""
