"""The fleet's credentials: its token (the OS keychain or a private file: ``tokens``), its
name for people (``fleet_name``) and the join codes that carry both to a new machine as a
URL or a QR code (``codes``)."""
