"""Tests of sparkcache.index: schema, migrations, the connection."""
