"""Scorers of the scored routing strategies, one per module; each states its formula."""
