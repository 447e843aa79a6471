"""Drafters behind one protocol (base.Drafter): EAGLE-3 head, n-gram prompt lookup, draft model."""
