"""Flight Recorder data, torch-free: a dump object (from a socket or a file) parsed into typed entries
(``trace``) and its sequence numbers translated into the collective domain (``domain``). Pure: no I/O."""
