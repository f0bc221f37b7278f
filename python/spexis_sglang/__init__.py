"""Spexis on SGLang."""
