"""minikit: small utilities (statistics, text, ranges, money, grids)."""
