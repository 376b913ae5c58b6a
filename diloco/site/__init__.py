"""A site: the inner trainer and its half of the outer sync."""
