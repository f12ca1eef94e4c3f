from frexporter.cli import main

raise SystemExit(main())
