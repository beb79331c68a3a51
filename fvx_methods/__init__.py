"""Training methods as pure loss and step functions."""
