"""Pure functions over the normalised trace model (pandas only)."""
