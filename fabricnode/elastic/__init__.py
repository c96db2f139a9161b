"""Elastic services: the mesh keeps declared models served through Slurm jobs.

servicefile  the service file (TOML): its format, the pure parser/validator, canonical bytes
"""
