"""One module per subcommand, each with ``register(subparsers)``: argument parsing and printing only; the work is
done by the typed core (contract, checks, derivations). Heavy libraries are imported only when a command runs.
``estimate`` asks one of five questions (the estimate, ``--fit``, ``--devices``, ``--sweep``, ``--what-if``): a
package with a module per question."""
