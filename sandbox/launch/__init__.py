"""The launcher of ``guard run`` and the process boundary around the agent.

- :mod:`sandbox.launch.run`: ``guard run``: the Session's mount and daemon in one trio loop,
  the agent started inside the sandbox, its output pumped into the quarantine, a summary;
- :mod:`sandbox.launch.isolation`: bubblewrap's arguments and the mount namespace;
  :mod:`sandbox.launch.landlock` and :mod:`sandbox.launch.enter` (the step inside the
  sandbox that applies Landlock and no_new_privs, then execs the agent);
- :mod:`sandbox.launch.lanes`: fast lanes bound natively where no forbidden pattern can reach;
- :mod:`sandbox.launch.supervisor`: the spawner thread and the agent's process tree
  (freeze, thaw, terminate; pid-reuse safe);
- :mod:`sandbox.launch.quarantine`: the capped logs and the CI digest;
  :mod:`sandbox.launch.exec`: ``guard exec``, one tool command quarantined and reported.
"""
