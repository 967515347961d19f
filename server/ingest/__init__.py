"""What agents send: the gRPC service, the checks on every message, and bundle uploads
written to disk.
"""
