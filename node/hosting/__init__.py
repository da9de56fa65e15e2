"""What this node runs for the instances placed on it.

- `instances`: its part of every instance naming it (a runner, or a pipeline stage), kept in step
  with the records.
- `stages`: the stage processes it starts and the entry's route through them.
- `replica_load`: the load it reports of the instances it is the entry of.
"""
