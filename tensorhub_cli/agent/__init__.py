"""The per-node agent process (``daemon``) and what it does on hub commands (``commands``)."""
