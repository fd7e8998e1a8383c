"""quantgate's evaluation side: run bundles, paired statistics and the release gate (see issues 5-7)."""
