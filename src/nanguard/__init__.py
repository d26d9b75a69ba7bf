"""nanguard."""
