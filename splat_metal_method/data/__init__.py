"""Data: the datamanager, the checked dataparser and the bundled synthetic demo scene."""
