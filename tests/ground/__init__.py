"""The ground layer (0): progress output and prompt files."""
