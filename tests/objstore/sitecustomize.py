"""Loaded by Python at start-up when this directory is on PYTHONPATH: serve gs:// from $FAKE_GCS_ROOT."""

import os

if os.environ.get("FAKE_GCS_ROOT"):
    from fake_gcs import install

    install(os.environ["FAKE_GCS_ROOT"])
