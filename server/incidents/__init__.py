"""An incident from trigger to verdict: what opens one, collecting every rank's dump, the
analysis in its own process, the bundle on disk, the store, and what happens after.

Imports the live state and the metrics registry, nothing else of the server.
"""
