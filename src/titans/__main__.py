from titans.cli import main

raise SystemExit(main())
