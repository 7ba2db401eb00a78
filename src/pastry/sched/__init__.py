"""Scheduling studies: program shapes (:mod:`.programs`), workloads shaped like the
Autellix paper's (:mod:`.workloads`), a discrete-event simulator that runs the real policy
objects (:mod:`.sim`), the clairvoyant SRPT yardstick (:mod:`.srpt`) and the inferlet that
replays a program on the real engine (:mod:`.replay`)."""
