"""The look every table and picture of the package shares (rich tables, inline SVG)."""
