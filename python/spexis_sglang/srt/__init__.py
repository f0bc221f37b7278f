"""Everything that touches SGLang internals lives here (design.md §1)."""
