"""Test helpers shared by tests_gpipe and tests_zoo."""
