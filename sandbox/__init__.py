"""sandbox: the process boundary of the guard, and the ``guard`` command line.

It builds on :mod:`guardfs` (never the reverse): today the ``guard`` CLI that checks
manifests and serves a guarded mount.
"""
