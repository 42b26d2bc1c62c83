"""sparkcache's alembic migrations, installed as ``sparkcache._migrations``.

Nothing here is imported by name: ``sparkcache.index.migrate`` hands this folder to
alembic as its ``script_location``.  See ``docs/index.md``.
"""
