"""The node sidecar agent: polls each local rank's flight recorder and talks to the coordinator."""
