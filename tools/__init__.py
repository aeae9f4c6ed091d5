"""Repository tooling that users do not run to train (not installed with the package): README and docs
results blocks (`make readme`)."""
