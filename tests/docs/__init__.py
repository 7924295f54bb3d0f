"""The documentation's checks and generators (README.md, docs/*.md, bench/README.md): `markdown` reads the pages,
`commands` holds each command to the code, `update` (`make docs`) makes the parts the code determines;
tests/test_docs.py runs them all."""
