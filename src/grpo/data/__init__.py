"""Datasets into prompts: tokenizing, checking and ordering a dataset's rows (`prompts`)."""
