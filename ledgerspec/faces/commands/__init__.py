"""One module per subcommand, each with ``register(subparsers)``: argument parsing and printing only; the work is
done by the typed core (contract, checks, derivations). Heavy libraries are imported only when a command runs."""
