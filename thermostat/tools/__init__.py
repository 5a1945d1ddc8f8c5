"""Tools behind the CLI that talk to servers from the outside (bench; later verify, diagnose)."""
