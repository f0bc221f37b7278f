"""Everything that touches SGLang internals lives here (docs/design.md §1)."""
