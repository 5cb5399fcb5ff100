"""Deployment artefacts (xpk, JobSet, Slurm) rendered from one parameter set: see render.py."""
