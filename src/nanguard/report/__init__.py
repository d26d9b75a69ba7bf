"""Terminal and HTML reports built from a run's events and bundles."""
