from fitdqn.cli import main

raise SystemExit(main())
