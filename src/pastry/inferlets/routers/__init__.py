"""Router programs, launchable as ``router-NAME`` (``pastry serve --router NAME[:ARG]``)."""
