"""The alembic revisions, oldest first.  Frozen once released: add a new file instead."""
