"""Built-in inferlets, launchable by name (file name with dashes)."""
