"""Documentation pages generated from the code (docs/choosing-a-strategy.md, docs/troubleshooting.md),
so they change when the code does; `python -m kiln.docgen` rewrites them and tests/docs fails when one
is stale. Nothing in kiln imports this package."""
