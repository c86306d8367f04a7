"""The `specd` command line and what it launches: `specd up` (the services as supervised
child processes), `specd serve ROLE`, `specd bench`, and the child-process helpers the
benchmarks and tests share. The one package that imports every service (and nothing
imports it but the benchmarks and the tests)."""
