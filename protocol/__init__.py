"""The shared language of Shoal: typed messages, chunk events and ids. Pure: no I/O here."""
