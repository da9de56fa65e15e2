"""The Shoal node process, one package per concern (see the README's Layout): `cluster`,
`control` (the leader and what nodes ask it), `hosting` (what this node runs), `serving` (a
request's path), `cli`, and below them `runner`, `pipeline`, `files`, `models`, `net`, `cpu`;
`serve` composes them into `shoal run`."""
