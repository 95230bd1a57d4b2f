"""`pdspark up`: a cluster (router + prefill and decode workers) started and supervised from one command, as child
processes or as Ray actors; and `ServiceProcess`, one pdspark service run as a child process."""
