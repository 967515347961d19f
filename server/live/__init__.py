"""What the coordinator knows of each job right now: the registry the gRPC handlers feed,
the stall rules over it, the straggler monitor and the agents' command mailboxes.

Imports nothing else of the server: incidents, integrations, ingest and the web read it.
"""
