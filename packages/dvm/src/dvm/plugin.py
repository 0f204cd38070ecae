"""dvm's Spore hooks."""
