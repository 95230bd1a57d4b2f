"""Moving a prompt's DSV4 cache from a prefill worker's pools into a decode worker's pools."""
